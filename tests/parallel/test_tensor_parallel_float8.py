"""FP8 under tensor parallelism: tp = 2 with torchao's Float8Linear (tensorwise scales) against FP8 on one
process, on CPU/gloo, through `engine.parallel.apply.parallelize` (FP8 first, then TP, then AdamW steps with
clipping). Both run bf16 autocast, whose rounding differs between a row-parallel sum over two ranks and one
matmul: the same comparison in plain bf16 runs alongside as the yardstick. Measured (torch 2.13 CPU, 5
steps): per-step loss gaps up to 4.9e-4 in FP8 (the first four within 9.3e-5) and 1.4e-4 in bf16. The TP
checkpoint then loads into a one-process FP8 model whose next loss is the TP model's."""

from __future__ import annotations

import json

import pytest

from tests.helpers.torchrun import torchrun

pytestmark = pytest.mark.slow  # float8 matmuls on CPU: about 30 s

SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist, torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from engine.config.job import JobConfig
from engine.model.transformer import Transformer
from engine.parallel.apply import parallelize
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.grad_norm import clip_grad_norm
from engine.parallel.tp import loss_context

dist.init_process_group("gloo")
out = sys.argv[1]
mesh = build_mesh(ParallelDims(tp=2), "cpu")
model_cfg = dict(dim=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, ffn_hidden_dim=128)
result = {}
for precision in ("fp8", "bf16"):
    cfg = JobConfig(model=model_cfg, train={"mixed_precision": precision, "seq_len": 32})
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    model = parallelize(copy.deepcopy(ref), cfg, mesh)
    parallelize(ref, cfg, None)
    if precision == "fp8":
        result["converted"] = [type(model.layers["0"].attention.wq).__name__,
                               type(model.layers["0"].attention.wq.weight).__name__]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    gaps = []
    for step in range(5):
        batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in ((ref, opts[0]), (model, opts[1])):
            with loss_context(m is model):  # loss parallel: the logits stay vocabulary-sharded
                with torch.autocast("cpu", torch.bfloat16):
                    logits = m(batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                if step == 4:  # the next step's loss, compared with the checkpoint's in one process below
                    losses.append(loss.item())
                    continue
                loss.backward()
            clip_grad_norm(m.parameters(), 0.5)
            opt.step(); opt.zero_grad()
            losses.append(loss.item())
        gaps.append(abs(losses[0] - losses[1]))
        tp_next = losses[1]
    result[precision] = gaps
    if precision == "fp8":
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{out}/ckpt")
        result["tp_next"] = tp_next
if dist.get_rank() == 0:
    json.dump(result, open(f"{out}/result.json", "w"))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""


def test_fp8_with_tensor_parallelism_matches_fp8_on_one_process(tmp_path, parity):
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F

    from engine.config.job import JobConfig
    from engine.model.transformer import Transformer
    from engine.parallel.apply import parallelize

    script = tmp_path / "fp8_tp.py"
    script.write_text(SCRIPT)
    result = torchrun(script, 2, str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    found = json.loads((tmp_path / "result.json").read_text())
    assert found["converted"] == ["Float8Linear", "DTensor"]  # the path claimed: float8 layers, TP-sharded
    assert len(found["fp8"]) == 5 and len(found["bf16"]) == 5
    # float8 has 3 mantissa bits: a bf16-level difference of an input flips some of its roundings, so the gap
    # is larger than bf16's, yet far below FP8's own gap from bf16 (0.015-0.024 on such a model, docs/parallelism.md).
    # Not derived: the statistical rounding model (tests/helpers/parity.py) with bf16's roundoff 2^-8 bounds these gaps
    # by ~1e-2, as large as the FP8-against-bf16 gap the test must tell apart; so these two stay set from the
    # measured gaps above (about 2× them), the one place the suite does so.
    for step, (fp8, bf16) in enumerate(zip(found["fp8"], found["bf16"]), 1):
        parity.within(f"fp8 loss step {step}", fp8, 1e-3)
        parity.within(f"bf16 loss step {step}", bf16, 3e-4)
    # The TP run's weights in one process (FP8 keeps names and fp32 dtypes): its next loss.
    cfg = JobConfig(
        model=dict(dim=64, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, ffn_hidden_dim=128),
        train={"mixed_precision": "fp8", "seq_len": 32},
    )
    model = parallelize(Transformer(cfg.model), cfg, None)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    model.load_state_dict(state["model"])
    batch = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).item()
    parity.within("the TP checkpoint's next loss in one process", abs(loss - found["tp_next"]), 1e-3)
