from setuptools import find_packages, setup

setup(
    name="ctx-plugin",
    version="0.1.0",
    description="Context-parallel attention (ring, zigzag, striped) and selective-recompute granularity "
                "for Megatron-LM, DeepSpeed and Hugging Face training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ctx_plugin", "ctx_plugin.*"]),
    python_requires=">=3.12",
    install_requires=["torch>=2.5", "numpy"],
    extras_require={
        "megatron": ["megatron-core>=0.16", "triton"],
        "deepspeed": ["deepspeed>=0.19"],
        "hf": ["transformers>=5.0,<6"],
        "flash": ["flash-attn>=2.0"],
        "plot": ["matplotlib"],
        "test": ["pytest>=8", "matplotlib"],
    },
    entry_points={
        "console_scripts": ["ctx-plugin = ctx_plugin.cli:main"],
        # Seams that a Megatron fork patched with patches/ looks up (see patches/README.md).
        "megatron.extra_args_providers": ["ctx_plugin = ctx_plugin.megatron.args:add_arguments"],
        "megatron.context_parallel_layout": ["ctx_plugin = ctx_plugin.megatron.hooks:local_positions"],
    },
)
