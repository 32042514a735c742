"""A stand-in for Megatron-LM's pretrain_gpt.py that runs on CPU.

Megatron's own ``pretrain`` asserts CUDA, so this script keeps the parts of pretrain_gpt.py that ctx_plugin's
entry point hooks into — Megatron's own ``parse_and_validate_args`` (parse, validate, set the global arguments
and tokenizer: data-parallel size, padded vocabulary) with the script's own ``extra_args_provider``, as
Megatron-LM's script calls it (core 0.19), ``GPTModel`` built from a
layer spec by name, and ``get_batch_on_this_cp_rank`` imported by name, fed batches built as Megatron's GPT dataset builds them (its own
``_get_ltor_masks_and_position_ids``: the causal attention mask by default, document masks and restarted position
ids with ``--reset-attention-mask``/``--reset-position-ids``, end-of-document tokens out of the loss with
``--eod-mask-loss``) and turned into PackedSeqParams as Megatron-LM 0.19's ``forward_step`` does — and replaces Megatron's training loop with a small CPU one (SGD;
gradients all-reduced over data × context ranks, as Megatron's DDP does). Run directly (without ctx_plugin) it
trains Megatron's own model: the reference; the CUDA calls of Megatron's local attention and RoPE are pointed at
the CPU (``_cpu_shims``), and so are the device queries of Megatron's argument validation. It does not import
``megatron.training.pretrain``, so the entry point does not ask for CUDA. With ``--exit-signal-handler`` it stops as
Megatron-LM's loop does (``checkpoint_and_decide_exit``): each iteration (``args.curr_iteration``) it asks Megatron's
signal handler, which Megatron's ``set_global_variables`` installed, whether any rank got the signal, and if so
"saves" (Megatron's ``latest_checkpointed_iteration.txt`` in ``--save``) and exits.
"""
import contextlib
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import random
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_cp_rank
import megatron.training.arguments as megatron_arguments
from megatron.training import get_signal_handler, get_tokenizer
from megatron.training.arguments import parse_and_validate_args


def extra_args(parser):
    parser.add_argument("--fake-report", default=None, help="write rank 0's losses here (JSON)")
    parser.add_argument("--fake-steps", type=int, default=3)
    parser.add_argument("--fake-eod-at", default=None,
                        help="end-of-document token positions per sample, e.g. '11,19/3' (samples cycle through them)")
    parser.add_argument("--fake-ignore-cu-seqlens", action="store_true",
                        help="call the model without PackedSeqParams even when the batch has cu_seqlens")
    return parser


def _cpu_shims():
    """Megatron's RoPE moves its frequencies to torch.cuda.current_device(); its local attention takes a buffer
    there and forks the CUDA RNG tracker around dropout (0 here); its recompute saves and restores RNG states."""
    class Tracker:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = random.get_cuda_rng_tracker = lambda *args, **kwargs: Tracker()
    # Megatron's recompute (tensor_parallel.checkpoint: --recompute-modules mlp/core_attn) saves the CUDA RNG state
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    megatron_arguments.get_device_arch_version = lambda: 9      # validate_args asks the GPU's generation at CP > 1
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"              # and then wants this set (as on a pre-Blackwell GPU)


def model_provider(args):
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                               ffn_hidden_size=args.ffn_hidden_size, use_cpu_initialization=True,
                               context_parallel_size=args.context_parallel_size, attention_dropout=0.0,
                               hidden_dropout=0.0, add_bias_linear=args.add_bias_linear,
                               add_qkv_bias=args.add_qkv_bias, init_method_std=args.init_method_std,
                               recompute_granularity=args.recompute_granularity,
                               recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                               recompute_modules=args.recompute_modules)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.seq_length, position_embedding_type=args.position_embedding_type)


def get_batch(step, args):
    """A micro-batch as Megatron's GPTDataset builds it, then Megatron-LM 0.19's get_batch (flatten, CP sharding)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
    eod = get_tokenizer().eod
    if args.fake_eod_at:                 # the documents end where asked, and only there
        ends = args.fake_eod_at.split("/")
        tokens[tokens == eod] = 0
        for row in range(args.micro_batch_size):
            tokens[row, [int(i) for i in ends[row % len(ends)].split(",") if i]] = eod
    samples = [_get_ltor_masks_and_position_ids(row[:-1], eod, args.reset_position_ids, args.reset_attention_mask,
                                                args.eod_mask_loss, args.create_attention_mask_in_dataloader)
               for row in tokens]
    mask = torch.stack([m for m, _, _ in samples]) if args.create_attention_mask_in_dataloader else None
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.stack([lm for _, lm, _ in samples]),
             "position_ids": torch.stack([p for _, _, p in samples]), "attention_mask": mask, "cu_seqlens": None,
             "cu_seqlens_padded": None, "max_seqlen": None, "local_cp_size": None, "hybrid_cp_group": None}
    return get_batch_on_this_cp_rank(flatten_batch_for_packed_sequences(batch), is_hybrid_cp=False)


def packed_seq_params(batch, args):
    """Megatron-LM 0.19's forward_step: THD PackedSeqParams from the batch's cu_seqlens, None without them."""
    cu, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    if cu is None or args.fake_ignore_cu_seqlens:
        return None
    cu = cu.squeeze(0)
    padded = padded.squeeze(0) if padded is not None else None
    bounds = padded if padded is not None else cu
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=int(batch["max_seqlen"].item()),
                           max_seqlen_kv=int(batch["max_seqlen"].item()), tokens_per_sample=args.seq_length)


if __name__ == "__main__":
    _cpu_shims()
    args = parse_and_validate_args(extra_args_provider=extra_args, args_defaults={"tokenizer_type": "NullTokenizer"})
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    torch.manual_seed(1234)
    model = model_provider(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    losses = []
    for step in range(args.fake_steps):
        args.curr_iteration = step
        batch = get_batch(step, args)
        per_token = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                          packed_seq_params=packed_seq_params(batch, args))
        stats = torch.stack([(per_token * batch["loss_mask"]).sum().detach(), batch["loss_mask"].sum()])
        dist.all_reduce(stats, group=dp_cp)
        opt.zero_grad()
        ((per_token * batch["loss_mask"]).sum() / stats[1]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_cp)
        opt.step()
        losses.append((stats[0] / stats[1]).item())
        print(f"rank {dist.get_rank()}: iteration {step + 1} loss {losses[-1]:.6f}", flush=True)
        if args.exit_signal_handler and any(get_signal_handler().signals_received()):
            if args.save and dist.get_rank() == 0:
                os.makedirs(args.save, exist_ok=True)
                with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(step + 1))
            print(f"rank {dist.get_rank()}: exiting program after receiving SIGTERM.", flush=True)   # Megatron's words
            break
    if dist.get_rank() == 0 and args.fake_report:
        with open(args.fake_report, "w") as f:
            json.dump({"losses": losses, "rope_class": type(getattr(model, "rotary_pos_emb", None)).__name__,
                       "model_class": type(model).__name__, "padded_vocab_size": args.padded_vocab_size,
                       "recompute": [model.config.recompute_granularity, model.config.recompute_modules],
                       "packed": batch["cu_seqlens"] is not None,
                       "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
