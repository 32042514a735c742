"""``+tile_loss`` on a megatron-core GPTModel: its output layer and language-model loss over sequence chunks.

:func:`use_tiled_loss` patches one built model instance (not Megatron's classes): when the model is called with
``labels`` in training or evaluation, its ``_postprocess`` gets an ``output_processor`` (megatron-core's own hook)
that runs, per chunk of sequence positions, exactly what Megatron runs on the whole sequence — the output layer
(``ColumnParallelLinear``, shared embedding weight included), the logit scaling (MuP), and the model's
``compute_language_model_loss`` (vocab-parallel cross-entropy, or the fused implementation the config selects) —
each chunk checkpointed (:func:`ctx_plugin.tiled_loss.map_chunks`), and returns the same per-token losses
``[batch, seq]``. Loss masking and reduction stay Megatron-LM's. Under tensor parallelism each chunk's logits are
this rank's vocabulary shard and the cross-entropy's all-reduces run per chunk, in the same order on every rank
(again in backward). Settings the chunking cannot reproduce exactly are refused.
"""
from __future__ import annotations

from ..tiled_loss import auto_tokens, map_chunks

_MARK = "_ctx_plugin_tiled_loss"


def _refusals(model) -> list[str]:
    config = model.config
    problems = []
    if getattr(config, "mtp_num_layers", None):
        problems.append("multi-token prediction (--mtp-num-layers) computes its own losses from whole logits before "
                        "the output layer")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append("--defer-embedding-wgrad-compute keeps the output layer's inputs in a buffer per call, which "
                        "chunks and their recomputation would fill several times")
    if getattr(model.output_layer, "sequence_parallel", False):
        problems.append("--sequence-parallel gathers the sequence inside the output layer, so chunks of this rank's "
                        "positions would not meet their labels")
    if type(model.output_layer).__name__ != "ColumnParallelLinear":
        problems.append(f"the output layer is {type(model.output_layer).__name__}, not megatron-core's "
                        "ColumnParallelLinear")
    return problems


def use_tiled_loss(model, tokens: int | None = None) -> None:
    """Makes ``model`` (a megatron-core GPTModel on the last pipeline stage; a no-op on stages without the output
    layer) compute its loss tiled: chunks of ``tokens`` tokens (positions × micro batch; at least one position per
    chunk; ``None``: :func:`ctx_plugin.tiled_loss.auto_tokens` of this rank's vocabulary shard). ValueError for
    settings the tiled loss cannot reproduce exactly."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"+tile_loss:<tokens> must be a positive int, got {tokens!r}")
    if not getattr(model, "post_process", False):
        return
    if hasattr(model, _MARK):
        raise ValueError("the tiled loss is already installed on this model")
    problems = _refusals(model)
    if problems:
        raise ValueError("+tile_loss cannot compute this model's loss exactly: " + "; ".join(problems)
                         + "; drop +tile_loss or the setting")
    original = model._postprocess

    def processor(*, hidden_states, output_layer, output_weight, labels, runtime_gather_output,
                  compute_language_model_loss, scale_logits, **_):
        vocab = (output_weight if output_weight is not None else output_layer.weight).shape[0]
        batch = hidden_states.shape[1]
        positions = max(1, (tokens if tokens is not None else auto_tokens(vocab)) // batch)

        def chunk(h, y):
            logits, _ = output_layer(h, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return compute_language_model_loss(y, scale_logits(logits))

        return map_chunks(chunk, hidden_states, labels, tokens=positions, hidden_dim=0, labels_dim=1, out_dim=1)

    def _postprocess(*args, **kwargs):
        from megatron.core.inference.utils import InferenceMode

        if kwargs.get("labels") is None or InferenceMode.is_active():
            return original(*args, **kwargs)          # logits asked for: nothing to tile
        if args:
            raise RuntimeError("GPTModel._postprocess was called positionally; ctx_plugin's tiled loss expects "
                               "megatron-core 0.19's keyword call")
        if kwargs.get("output_processor") is not None:
            raise ValueError("+tile_loss computes the loss through GPTModel's output_processor, and the caller passed "
                             "its own: drop +tile_loss or the output_processor")
        return original(**{**kwargs, "output_processor": processor})

    model._postprocess = _postprocess
    setattr(model, _MARK, tokens)
