"""The input check of :func:`ctx_plugin.hf.enable`: a forward pre-hook on the model (and on its base model and
decoder, for direct calls) that refuses, before any communication and identically on every rank of the group,
inputs ctx_plugin cannot honour under context parallelism, and hands the forward's packed documents to its
attention calls. ``model.forward(...)`` called itself (PEFT's tuner calls it so) runs no hooks of the model: the
model's ``forward`` on the instance (:func:`check_direct_forward`) runs the same check then, so what only the model's
own check sees (``labels=``, ``logits_to_keep``) is checked on that path too."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from ..core.api import sequence_positions
from ..core.compiler import opaque
from ..core.config import CPConfig
from ..core.groups import CPGroups
from ..core.rules import check_documents_fit
from ..packing import DOCUMENTS_KEYWORD, HF_DOCUMENT_KEYWORDS, hf_documents
from .checks import Running


TEXT_ARGUMENTS = frozenset({"input_ids", "inputs_embeds", "position_ids", "attention_mask", "labels", "logits_to_keep",
                            "use_cache", "cache", "past_key_values", "cache_position", "output_attentions",
                            "output_hidden_states", "return_dict", DOCUMENTS_KEYWORD, *HF_DOCUMENT_KEYWORDS})
"""A multimodal model's forward arguments that concern its text model (each checked on its own); any other set is
refused (``"modalities"``)."""


class InputCheck:
    """Forward pre-hook: refuses inputs ctx_plugin cannot honour. Every rank computes its flags, the CP group sums
    them (one all-reduce of problems × ranks), and every rank raises the same error."""

    PROBLEMS = {
        "mask": "cannot apply a padding/custom attention_mask under context parallelism; pass attention_mask=None "
                "with unpadded sequences (mask padded labels with -100 instead)",
        "cache": "a KV cache built from context-parallel shards is not a model's cache; ctx_plugin runs "
                 "training/prefill only: call the model with use_cache=False",
        "no_positions": "position_ids were not given, so transformers would number each rank's tokens from 0 "
                        "(wrong positions); pass this rank's share of the global positions (ctx_plugin."
                        "shard_sequence of torch.arange(seq_len), or ctx_plugin.sequence_positions)",
        "documents": "the packed documents (ctx_plugin_documents, or cu_seq_lens_q/cu_seq_lens_k with max_length_q/"
                     "max_length_k) are not valid documents of the global sequence (this rank's length × CP size) "
                     "that the backend can split: give the whole packed sequence's cumulative lengths, the same on "
                     "every rank, each document a multiple of ctx_plugin.core.rules.document_unit (pad_documents)",
        "positions": "position_ids are not this rank's share of the global positions 0..seq_len-1, or with packed "
                     "documents of the positions restarting at 0 in each document (ctx_plugin.shard_sequence of "
                     "the global position_ids, or ctx_plugin.sequence_positions(..., documents=))",
        "unsharded": "position_ids are 0..n-1 and the tokens the same on every rank, as for a whole sequence: was "
                     "every rank given the whole sequence rather than its shard? shard input_ids, position_ids and "
                     "the labels with ctx_plugin.shard_sequence (each rank then holds seq_len / CP tokens)",
        "restarts": "position_ids restart at 0 inside the sequence (packed documents, as transformers' "
                    "DataCollatorWithFlattening packs them) but no documents reach the attention, which would attend "
                    "across them: pass the global sequence's cumulative lengths as cu_seq_lens_q/cu_seq_lens_k "
                    "(DataCollatorWithFlattening(return_flash_attn_kwargs=True), before sharding) or "
                    "ctx_plugin_documents= (ctx_plugin.packing.documents_of_batch of the global batch)",
        "labels": "labels= makes transformers shift labels inside this rank's shard (wrong targets at the shard "
                  "edges); shift labels before sharding and compute the loss from the logits (see the README)",
        "logits_to_keep": "a nonzero logits_to_keep keeps the last tokens (or the indices) of this rank's shard, "
                          "not of the global sequence; call the model with logits_to_keep=0 and pick the logits "
                          "after ctx_plugin.gather_sequence",
        "token_ids": "input_ids outside the model's vocabulary (0..num_embeddings-1 of its input embeddings): the "
                     "embedding would fail on those ranks only and leave the others waiting in the attention",
        "modalities": "inputs other than text (pixel_values, token_type_ids, ...) for a multimodal model: ctx_plugin "
                      "runs its text model only (its encoders keep their own attention, which would see one rank's "
                      "inputs as a whole, and image tokens' bidirectional blocks come from a mask ctx_plugin's "
                      "attention does not take); train on text alone (input_ids, position_ids)",
        "prefix": "token_type_ids with config.prefix_lm=True make the tokens marked 1 a bidirectional prefix, "
                  "through a mask ctx_plugin's attention does not take (it would run them causally); leave "
                  "token_type_ids out (causal language modelling) or set config.prefix_lm=False",
        "encoder": "encoder_hidden_states / encoder_attention_mask: cross-attention to an encoder's states is not "
                   "context-parallel attention over the sequence (and the encoder's padding mask would not reach it); "
                   "use a decoder-only model, or run the model without them",
    }

    def __init__(self, cp_config: CPConfig, groups: CPGroups, signature: inspect.Signature, running: Running,
                 multimodal: bool = False):
        self.cp_config, self.groups, self.signature, self.running = cp_config, groups, signature, running
        self.var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        self.multimodal = multimodal
        """The module's config has encoders of other modalities: only :data:`TEXT_ARGUMENTS` may be set."""

    def _documents(self, arguments: dict, tokens):
        """(documents, whether they are invalid) of this forward, from the keywords that reach the attention."""
        extra = {**arguments, **arguments.get(self.var_keyword, {})} if self.var_keyword else arguments
        if not any(extra.get(k) is not None for k in (DOCUMENTS_KEYWORD, *HF_DOCUMENT_KEYWORDS)):
            return None, False
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            return None, True
        try:
            docs = hf_documents(extra, tokens.shape[1] * self.groups.size)
            check_documents_fit(self.cp_config, docs, self.groups.size)
        except (TypeError, ValueError):
            return None, True
        return docs, False

    def _flags(self, model, arguments: dict, tokens, device: torch.device, documents, bad_documents: bool) -> list:
        mask, positions = arguments.get("attention_mask"), arguments.get("position_ids")
        extra = arguments.get(self.var_keyword) or {} if self.var_keyword else {}
        use_cache = arguments.get("use_cache")
        use_cache = getattr(model.config, "use_cache", False) if use_cache is None else use_cache
        keep = arguments.get("logits_to_keep")
        flags = {"mask": False if mask is None else
                 (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or (mask == 0).any()),
                 # transformers 5.24 names the cache `cache` (past_key_values: deprecated, arrives in **kwargs)
                 "cache": bool(use_cache) or _given(arguments, extra, "cache", "past_key_values"),
                 "documents": bad_documents, "no_positions": positions is None, "positions": False,
                 "unsharded": False, "restarts": False,
                 "labels": arguments.get("labels") is not None,
                 "logits_to_keep": keep is not None and (isinstance(keep, torch.Tensor) or keep != 0),
                 "token_ids": _outside_vocabulary(model, arguments.get("input_ids")),
                 "modalities": self.multimodal and any(value is not None and value is not False
                                                       for name, value in arguments.items()
                                                       if name not in TEXT_ARGUMENTS and name != self.var_keyword),
                 "prefix": _given(arguments, extra, "token_type_ids")
                 and getattr(getattr(model, "config", None), "prefix_lm", False) is True,
                 "encoder": _given(arguments, extra, "encoder_hidden_states", "encoder_attention_mask")}
        if isinstance(positions, torch.Tensor) and isinstance(tokens, torch.Tensor) \
                and positions.shape[-1] != tokens.shape[1]:
            flags["positions"] = True
        elif isinstance(positions, torch.Tensor):
            try:
                want = sequence_positions(positions.shape[-1] * self.groups.size, config=self.cp_config,
                                          groups=self.groups, device=positions.device, documents=documents)
                wrong = positions != want
                if documents is None and not bad_documents:
                    restarts = (wrong & (positions == 0)).any()          # zeros where the sequence goes on
                    flags["restarts"], flags["positions"] = restarts, wrong.any() & ~restarts
                    # a whole sequence's positions 0..n-1: a hint (1 + the tokens' fingerprint, 0 otherwise), made a
                    # problem in __call__ when every rank has it with the same tokens
                    whole = (positions == torch.arange(positions.shape[-1], device=positions.device)).all()
                    flags["unsharded"] = torch.where(whole, _fingerprint(tokens) + 1, 0)
                else:
                    flags["positions"] = wrong.any()
            except ValueError:
                flags["positions"] = True
        return [torch.as_tensor(flags[k], device=device).to(torch.int32) for k in self.PROBLEMS]

    @opaque
    def __call__(self, model, args, kwargs):
        if self.running.module is not None:     # inside the forward of a model whose check ran (model.model(...))
            return None
        arguments = self.signature.bind_partial(*args, **kwargs).arguments
        tokens = arguments.get("input_ids")
        tokens = arguments.get("inputs_embeds") if tokens is None else tokens
        groups = self.groups
        # The CPU-side group of the rank-agreement check when there is one (no GPU synchronisation), else the
        # context-parallel group itself, on a device its backend serves.
        group, device = groups.check_group, torch.device("cpu")
        if group is None:
            group = groups.group
            device = tokens.device if isinstance(tokens, torch.Tensor) else device
            if groups.size > 1 and device.type not in groups.device_types:
                device = torch.device("cpu")
        documents, bad_documents = self._documents(arguments, tokens)
        mine = torch.stack(self._flags(model, arguments, tokens, device, documents, bad_documents))
        flags = torch.zeros(len(self.PROBLEMS), groups.size, dtype=torch.int32, device=device)
        flags[:, groups.rank] = mine
        if groups.size > 1:
            dist.all_reduce(flags, group=group)
        rows = dict(zip(self.PROBLEMS, flags.tolist()))
        off = [a or b for a, b in zip(rows["restarts"], rows["positions"])]
        if all(rows["unsharded"]) and len(set(rows["unsharded"])) == 1 and any(off):
            # positions 0..n-1 and the same tokens on every rank: each got the whole sequence
            rows.update(unsharded=off, restarts=[0] * groups.size, positions=[0] * groups.size)
        else:
            rows["unsharded"] = [0] * groups.size
            if any(rows["restarts"]):   # the other ranks' positions are off for the same reason: one message
                rows["positions"] = [0] * groups.size
        found = [f"{self.PROBLEMS[name]} (CP ranks {[r for r, f in enumerate(row) if f]})"
                 for name, row in rows.items() if any(row)]
        if found:
            raise ValueError("ctx_plugin: " + "; ".join(found))
        self.running.start(model, documents)
        if documents is not None:     # read once per forward: every layer's attention gets them as one object
            kwargs = {k: v for k, v in kwargs.items() if k not in HF_DOCUMENT_KEYWORDS}
            return args, {**kwargs, DOCUMENTS_KEYWORD: documents}
        return None


def _fingerprint(tokens) -> torch.Tensor:
    """A position-weighted sum of integer ``input_ids`` modulo 2^31 - 2 (ranks given the same tokens have the same
    one); -1 for anything else (``inputs_embeds``), so that the hint it makes is 0."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dim() < 2:
        return torch.tensor(-1)
    weights = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
    return (tokens.long() * weights).sum() % (2 ** 31 - 2)


def _given(arguments: dict, extra: dict, *names: str) -> bool:
    """Whether a forward got any of ``names`` (not None), as a parameter or in its ``**kwargs``."""
    return any(where.get(name) is not None for where in (arguments, extra) for name in names)


def _outside_vocabulary(model, ids) -> bool | torch.Tensor:
    """Whether integer ``input_ids`` hold a token the model's input embeddings do not have (a tensor: no host sync)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.numel() == 0:
        return False
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    size = getattr(embeddings, "num_embeddings", None)
    return False if size is None else ((ids < 0) | (ids >= size)).any()


def check_direct_forward(model, check: InputCheck, running: Running) -> None:
    """Gives ``model`` a ``forward`` on the instance that runs ``check`` (and ends the checked forward, as the model's
    forward hook does) when the call did not come through ``model(...)``, whose forward pre-hook checked it. The
    wrapped forward keeps the signature and whatever ``model.forward`` was (e.g. Accelerate's autocast wrapper);
    enabling again replaces the check and the running record, not the wrapper."""
    model._ctx_plugin_direct_check = (check, running)
    if getattr(model.forward, "_ctx_plugin_direct", False):
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        check_now, running_now = model._ctx_plugin_direct_check
        if running_now.module is not None:        # called by model(...), whose pre-hook checked this forward
            return inner(*args, **kwargs)
        changed = check_now(model, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        output = None
        try:
            output = inner(*args, **kwargs)
        finally:
            running_now(model, args, output)
        return output

    forward._ctx_plugin_direct = True
    model.forward = forward
