"""Our training step vs Hugging Face `transformers` LlamaForCausalLM + torch.optim.AdamW, same process.

Both models get the same shape, batch, sequence length, dtype and thread count. Forge's step is the one
`forge train` runs: its model, its loss (`train.loss_fn`, default as configured; `--loss-fn` picks
another), `train.compile_model` with `--compile`. `transformers` gets Forge's plain cross-entropy on its
logits (the same computation as its own `ForCausalLMLoss`).
`transformers` runs twice: with torch.optim.AdamW as constructed by default (the usual HF training
step) and with the fused AdamW kernel Forge uses, so the optimizer's share of the difference is visible.
Steps are timed in alternating rounds (ours, theirs, ours, …) so machine drift hits both alike.
A third entry, `kernels_only`, times just the step's matrix multiplies (in the layouts the compiled step
uses) and its attention forward + backward, on random tensors of the same shapes: the kernels both
steps run and neither can skip. `ratio_transformers_over_kernels_only` is therefore the most any step
with these kernels could be ahead of `transformers`, and forge / kernels_only is Forge's own overhead.
`setup.linear_output_dtypes` records what the linear layers of each model actually produced in one forward
under the step's autocast (the run stops if that is not `--dtype`): proof that e.g. bf16 really ran.

    python benchmarks/bench_train_step.py                      # CPU, fp32, the debug-sized model
    python benchmarks/bench_train_step.py --dim 512 --n-layers 8 --seq-len 512
    python benchmarks/bench_train_step.py --device cuda --dtype bf16 --dim 2048 --n-layers 16 --batch-size 8 --seq-len 2048
"""

from __future__ import annotations

import math
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import transformers
from bench_args import emit, model_config, model_parser

from engine.config.job import JobConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.config.train import TrainConfig
from engine.model import build_model
from engine.parallel.apply import parallelize
from engine.precision import COMPUTE_DTYPES, autocast
from engine.train.losses import build_loss, cross_entropy
from engine.train.optim import build_optimizer


def hf_llama(cfg: ModelConfig) -> torch.nn.Module:
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(hf_cfg)


def linear_output_dtypes(model: torch.nn.Module, call, device, dtype) -> list[str]:
    """The dtypes `model`'s linear layers produce in one forward (`call(model)`) under the step's autocast."""
    seen: set[str] = set()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_hook(lambda _m, _a, out: seen.add(str(out.dtype))) for m in linears]
    with torch.no_grad(), autocast(device, dtype):
        call(model)
    for handle in handles:
        handle.remove()
    return sorted(seen)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def step_timer(model, optimizer, loss_of, batch, device, dtype, clock=time.perf_counter):
    inputs, labels = batch

    def step() -> float:
        start = clock()
        with autocast(device, dtype):
            loss = loss_of(model, inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - start

    return step


def kernels_timer(cfg: ModelConfig, batch_size: int, seq_len: int, chunk: int, device, dtype, clock=time.perf_counter):
    """One step's unavoidable kernels, nothing else: per layer the seven projections' forward matmuls and, for
    each, its weight gradient (gradᵀ @ input) and input gradient (grad @ weight), and SDPA forward + backward;
    then the output head's three matmuls (logits, their input and weight gradients) `chunk` tokens at a time.
    No norms, activations, residuals, softmax of the loss, optimizer or clipping: what the step adds to these
    is overhead a faster implementation could remove; these kernels it cannot."""
    tokens, dim, ffn, vocab = batch_size * seq_len, cfg.dim, cfg.ffn_dim, cfg.vocab_size
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    x, act, grad_ffn, grad_dim, grad_q, grad_kv = (
        t(tokens, dim),
        t(tokens, ffn),
        t(tokens, ffn),
        t(tokens, dim),
        t(tokens, q_out),
        t(tokens, kv_out),
    )
    wq, wkv, wo, w13, w2 = t(q_out, dim), t(kv_out, dim), t(dim, q_out), t(ffn, dim), t(dim, ffn)
    forward = ((x, wq), (x, wkv), (x, wkv), (grad_q, wo), (x, w13), (x, w13), (act, w2))
    backward = (
        (grad_dim, act, w2),
        (grad_ffn, x, w13),
        (grad_ffn, x, w13),
        (grad_dim, grad_q, wo),
        (grad_q, x, wq),
        (grad_kv, x, wkv),
        (grad_kv, x, wkv),
    )
    # Heads laid out as the model hands them to SDPA: [batch, heads, seq, head_dim] views of [batch, seq, heads, head_dim].
    q, k, v = (
        t(batch_size, seq_len, heads, cfg.head_dim).transpose(1, 2).requires_grad_()
        for heads in (cfg.n_heads, cfg.kv_heads, cfg.kv_heads)
    )
    grad_out = t(batch_size, seq_len, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    head, hidden, grad_logits = t(vocab, dim), t(chunk, dim), t(chunk, vocab)
    grad_head = torch.zeros(vocab, dim, device=device, dtype=dtype)

    def step() -> float:
        start = clock()
        for _ in range(cfg.n_layers):
            for inputs, weight in forward:
                inputs @ weight.T
            for grad, inputs, weight in backward:
                grad.T @ inputs
                grad @ weight
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.kv_heads != cfg.n_heads).backward(
                grad_out
            )
        for _ in range(math.ceil(tokens / chunk)):
            hidden @ head.T
            grad_logits @ head
            grad_head.addmm_(grad_logits.T, hidden)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - start

    return step


def main() -> None:
    parser = model_parser(__doc__, batch_size=16, warmup=3, steps=8)
    parser.add_argument("--loss-fn", default=TrainConfig().loss_fn, help="Forge's train.loss_fn")
    parser.add_argument("--compile", action="store_true", help="Forge with train.compile_model = true")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (all threads), for a machine other jobs share",
    )
    args = parser.parse_args()
    train_cfg = TrainConfig(loss_fn=args.loss_fn, compile_model=args.compile)
    clock = CLOCKS[args.clock]

    device, dtype = torch.device(args.device), COMPUTE_DTYPES[args.dtype]
    cfg = model_config(args)
    torch.manual_seed(0)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device) for _ in range(2))
    ours = build_model(cfg).to(device)
    theirs, theirs_fused = hf_llama(cfg).to(device), hf_llama(cfg).to(device)
    # before compile, which would recompile around the hooks; fp8 swaps Forge's linears, so it is not checked
    ran = {
        "forge": linear_output_dtypes(ours, lambda m: m(batch[0]), device, dtype),
        "transformers": linear_output_dtypes(theirs, lambda m: m(input_ids=batch[0]), device, dtype),
    }
    if args.dtype != "fp8":
        assert all(found == [str(dtype)] for found in ran.values()), (args.dtype, ran)
    ours_train = parallelize(ours, JobConfig(model=cfg, train=train_cfg))  # what forge train applies on one device
    assert ours.num_parameters() == theirs.num_parameters(), (ours.num_parameters(), theirs.num_parameters())
    hf_loss = lambda m, x, y: cross_entropy(m(input_ids=x).logits, y)  # noqa: E731
    adamw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    timers = {
        "forge": step_timer(
            ours_train, build_optimizer(ours, OptimizerConfig()), build_loss(train_cfg), batch, device, dtype, clock
        ),
        "transformers": step_timer(
            theirs, torch.optim.AdamW(theirs.parameters(), **adamw), hf_loss, batch, device, dtype, clock
        ),
        "transformers_fused_adamw": step_timer(
            theirs_fused,
            torch.optim.AdamW(theirs_fused.parameters(), fused=True, **adamw),
            hf_loss,
            batch,
            device,
            dtype,
            clock,
        ),
        # the head's matmuls in the chunks Forge's chunked loss uses (the plain loss: all tokens at once, same FLOPs)
        "kernels_only": kernels_timer(
            cfg,
            args.batch_size,
            args.seq_len,
            train_cfg.ce_chunk_size if train_cfg.loss_fn == "chunked_cross_entropy" else args.batch_size * args.seq_len,
            device,
            dtype,
            clock,
        ),
    }
    for step in timers.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, step in timers.items():
            times[name] += [step() for _ in range(args.steps)]
    tokens = args.batch_size * args.seq_len
    result = {
        name: {"median_step_sec": statistics.median(t), "tokens_per_sec": tokens / statistics.median(t)}
        for name, t in times.items()
    }
    for name in ("transformers", "transformers_fused_adamw"):
        result[f"ratio_forge_over_{name}"] = result["forge"]["tokens_per_sec"] / result[name]["tokens_per_sec"]
    # The ceiling: transformers' step over the kernels alone; and what Forge spends beyond them.
    kernels = result["kernels_only"]["median_step_sec"]
    result["ratio_transformers_over_kernels_only"] = result["transformers"]["median_step_sec"] / kernels
    result["forge_overhead_over_kernels_only"] = result["forge"]["median_step_sec"] / kernels - 1
    result["setup"] = {
        **vars(args),
        "parameters": ours.num_parameters(),
        "threads": torch.get_num_threads(),
        "linear_output_dtypes": ran,
        "clock": args.clock,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)",
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
