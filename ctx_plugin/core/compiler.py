"""ctx_plugin's attention under ``torch.compile``: run eagerly, with a graph break around each call.

The attention plans each call on the host (the ranks' agreement, the ring's steps, packed documents' tables built
with NumPy) and communicates; Dynamo tracing into that failed on some ranks while the others waited in a collective.
:func:`opaque` keeps the compiler out of the public functions and the framework adapters' attention entry points;
the model around them compiles, and what changes from call to call (documents, windows) is read on every call.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def opaque(fn: F) -> F:
    """``fn`` as ``torch.compiler.disable(fn)`` makes it, with ``torch._dynamo`` imported at the first call instead of
    at import (it imports triton: about a second, and an optional dependency ctx_plugin's import must not pull in).
    ``torch._disable_dynamo`` is torch's own lazy form of that decorator."""
    return torch._disable_dynamo(fn)
