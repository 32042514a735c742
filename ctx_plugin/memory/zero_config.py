"""A DeepSpeed config's ``zero_optimization`` read by DeepSpeed's own parser (``get_zero_config``): a misspelt key
is an error, ``"3"`` is stage 3, ``prefetch_bucket_size`` and ``stage3_prefetch_bucket_size`` are one setting, and
``cpu_offload`` is ``offload_optimizer`` — as the engine reads them."""
from __future__ import annotations

import contextlib
import io
import logging
import sys


def _get_zero_config():
    """DeepSpeed's parser, imported without the line DeepSpeed's logger prints on stdout when it is first imported
    (the accelerator it detected): a ``ctx-plugin`` command's output is its own. The logger keeps printing to
    stdout afterwards."""
    if "deepspeed" in sys.modules:
        from deepspeed.runtime.zero.config import get_zero_config
        return get_zero_config
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            from deepspeed.runtime.zero.config import get_zero_config
    except ImportError:
        raise ValueError("a DeepSpeed config is read with DeepSpeed's own parser: pip install "
                         "'ctx-plugin[deepspeed]'") from None
    for handler in logging.getLogger("DeepSpeed").handlers:      # created while stdout was the buffer
        if getattr(handler, "stream", None) is buffer:
            handler.setStream(sys.stdout)
    return get_zero_config


def zero_config(config: dict):
    """``config``'s zero_optimization as DeepSpeed's ``DeepSpeedZeroConfig``; ValueError naming each problem ("auto",
    which the HF Trainer resolves from the model, by name: give the number)."""
    section = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    if not isinstance(section, dict):
        raise ValueError("the DeepSpeed config's zero_optimization must be an object")
    auto = [k for k, v in section.items() if v == "auto"]
    if auto:
        raise ValueError(f"zero_optimization {', '.join(auto)}: \"auto\" is resolved by the HF Trainer from the "
                         f"model; give the number of elements it resolves to")
    get_zero_config = _get_zero_config()
    try:
        return get_zero_config(config)
    except ValueError as e:                                  # pydantic's ValidationError
        problems = [f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors()] if hasattr(e, "errors") \
            else [" ".join(str(e).split())]
        raise ValueError(f"the DeepSpeed config's zero_optimization: {'; '.join(problems)}") from None
