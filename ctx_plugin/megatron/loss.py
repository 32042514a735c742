"""``+tile_loss`` on a megatron-core GPTModel: its output layer and language-model loss over sequence chunks.

:func:`use_tiled_loss` patches one built model instance (not Megatron's classes): when the model is called with
``labels`` in training or evaluation, its ``_postprocess`` gets an ``output_processor`` (megatron-core's own hook)
that runs, per chunk of sequence positions, exactly what Megatron runs on the whole sequence — the output layer
(``ColumnParallelLinear``, shared embedding weight included), the logit scaling (MuP), and the model's
``compute_language_model_loss`` (vocab-parallel cross-entropy, or the fused implementation the config selects) —
each chunk checkpointed (:func:`ctx_plugin.tiled_loss.map_chunks`), and returns the same per-token losses
``[batch, seq]``. Loss masking and reduction stay Megatron-LM's. Under tensor parallelism each chunk's logits are
this rank's vocabulary shard and the cross-entropy's all-reduces run per chunk, in the same order on every rank
(again in backward); with sequence parallelism each chunk takes the same rows of every TP rank's slice, which the
output layer gathers. Settings the chunking cannot reproduce exactly are refused.
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
    if type(model.output_layer).__name__ != "ColumnParallelLinear":
        problems.append(f"the output layer is {type(model.output_layer).__name__}, not megatron-core's "
                        "ColumnParallelLinear")
    return problems


def use_tiled_loss(model, tokens: int | None = None) -> None:
    """Makes ``model`` (a megatron-core GPTModel on the last pipeline stage; a no-op on stages without the output
    layer) compute its loss tiled: chunks of ``tokens`` logits rows on this rank (positions × micro batch × the TP
    size under sequence parallelism; at least one position per chunk; ``None``:
    :func:`ctx_plugin.tiled_loss.auto_tokens` of this rank's vocabulary shard). ValueError for settings the tiled
    loss cannot reproduce exactly."""
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
        local, batch = hidden_states.shape[:2]
        # Sequence parallelism: this TP rank holds positions [r·local, (r+1)·local) of the sequence, and the output
        # layer all-gathers each chunk's rows from every TP rank (rank-major): chunk i meets the labels at
        # r·local + [i·c, (i+1)·c) for every r, i.e. labels viewed [batch, tp, local] narrowed along the last dim.
        tp = output_layer.tp_group.size() if output_layer.sequence_parallel else 1
        if labels.shape != (batch, local * tp):
            raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states [{local}, {batch}, ...] "
                             f"(×{tp} tensor-parallel ranks under sequence parallelism)")
        rows = tokens if tokens is not None else auto_tokens(vocab)      # logits rows of one chunk on this rank
        positions = max(1, rows // (batch * tp))

        def chunk(h, y):                     # y: [batch, tp, c]
            logits, _ = output_layer(h, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return compute_language_model_loss(y.reshape(batch, -1), scale_logits(logits)).view(batch, tp, -1)

        losses = map_chunks(chunk, hidden_states, labels.view(batch, tp, local), tokens=positions, hidden_dim=0,
                            labels_dim=2, out_dim=2)
        return losses.reshape(batch, tp * local)

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
