"""megatron-core integration: command-line flags, a layer spec whose core attention is ctx_plugin's, batch
sharding and RoPE positions for every layout.

This package imports megatron only inside the functions that need it (``pip install 'ctx-plugin[megatron]'``).
The seams it uses are described in README.md ("Megatron-LM / megatron-core"); only this adapter reads Megatron's
parallel state.
"""


def require_megatron():
    """Imports megatron.core, or raises ImportError saying how to install it."""
    try:
        import megatron.core
    except ImportError as e:
        raise ImportError("ctx_plugin's Megatron integration needs megatron-core (Python >= 3.12): "
                          "pip install 'ctx-plugin[megatron]'") from e
    return megatron.core
