"""Stock DeepSpeed PipelineEngine on HF LLaMA layers: what a user would run instead of us.

The shared anchor script (`shared/anchors/ds_pipe_anchor.py`) with the same shapes and settings,
plus what `bench/scale.py` compares: every rank's peak memory, a steady-state median of step
times, and one step recorded by `hetloco_ds.profiling` exactly as our CLI's `train.profile_step`
records ours (DeepSpeed's instructions labelled the same way).

    torchrun --nproc_per_node 4 bench/stock_pipe.py --stages 2 --model 1B --vocab 8192 --mb 4 --gas 8 \
        --seq 1024 --bf16 --steps 20 --out-json OUT.json [--profile-dir DIR]
    python bench/stock_pipe.py --cpu-smoke      # 2 gloo ranks, tiny model, on this CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def llama_shape(model: str, vocab: int):
    """The preset `model` (hetloco_ds.presets, the shapes ours trains), untied, SDPA attention."""
    from hetloco_ds.presets import model_config_for

    cfg = model_config_for(model, vocab)
    cfg.tie_word_embeddings = False
    cfg._attn_implementation = "sdpa"
    return cfg


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, ids):
        return self.embed(ids)


class Block(nn.Module):
    def __init__(self, cfg, idx):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        cfg._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(cfg, idx)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, h):
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, cfg):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, h):
        return self.lm_head(self.norm(h))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1))


def label_instructions(engine) -> None:
    """DeepSpeed's instructions as `pipe.<name>` ranges in a profile, by our adapter's rule. Only
    the map's labels are ours: it dispatches to the stock engine's own methods by name."""
    from hetloco_ds.patches.engine import labelled_instruction_map

    engine._INSTRUCTION_MAP = labelled_instruction_map()


def run(a) -> dict | None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from hetloco_ds import profiling

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(dist_backend="nccl")
    else:  # DeepSpeed's CPU backend would JIT-build its shared-memory op first; ours skips that, nothing else
        from hetloco_ds.build import init_distributed

        init_distributed()
    cfg = llama_shape(a.model, a.vocab)
    specs = [LayerSpec(Embed, cfg)] + [LayerSpec(Block, cfg, i) for i in range(cfg.num_hidden_layers)] + [LayerSpec(Head, cfg)]
    net = PipelineModule(layers=specs, num_stages=a.stages, loss_fn=loss_fn, partition_method="parameters")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds_cfg = {"train_micro_batch_size_per_gpu": a.mb, "gradient_accumulation_steps": a.gas, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "bf16": {"enabled": a.bf16}}
    cuda = torch.cuda.is_available()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    eng, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=ds_cfg)
    label_instructions(eng)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)

    def data():
        g = torch.Generator(device="cpu").manual_seed(0)
        while True:
            ids = torch.randint(0, cfg.vocab_size, (a.mb, a.seq), generator=g).to(dev)
            yield ids, ids

    it = data()
    times = []
    for step in range(1, a.steps + 1):
        sync()
        t = time.perf_counter()
        if step == a.profile_step and a.profile_dir:
            with profiling.record_step(a.profile_dir, eng.global_rank, dev, trace=a.trace):
                loss = eng.train_batch(data_iter=it)
        else:
            loss = eng.train_batch(data_iter=it)
        sync()
        times.append(time.perf_counter() - t)
    steady = [t for i, t in enumerate(times, 1) if i > a.warmup and i != a.profile_step]
    peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    nparams = torch.tensor([float(sum(p.numel() for p in net.parameters()))], device=dev)
    torch.distributed.all_reduce(nparams)
    replicas = world // a.stages
    nparams = nparams.item() / replicas
    tokens = a.mb * a.gas * a.seq * replicas
    dt = statistics.median(steady)
    rank = eng.global_rank
    # The ranks leave the group together: a rank that exits while its peer still holds their gloo
    # connection can abort in the group's destructor at interpreter exit (SIGABRT, "terminate
    # called without an active exception": 2 smoke runs in 6 on 2 cores)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    flops_tok = 6 * nparams + 12 * cfg.num_hidden_layers * cfg.hidden_size * a.seq
    return dict(system="stock_deepspeed", model=a.model, stages=a.stages, replicas=replicas, nparams=nparams,
                micro_batch=a.mb, grad_accum=a.gas, seq_len=a.seq, bf16=a.bf16, steps=a.steps, warmup=a.warmup,
                step_seconds=times, median_step_seconds=dt, global_tokens_per_s=tokens / dt,
                tokens_per_s_per_gpu=tokens / dt / world,
                mfu=flops_tok * tokens / dt / world / 989e12 if cuda else None,
                peak_allocated_gib_by_rank=[p / 2**30 for p in peaks], loss=float(loss),
                card=torch.cuda.get_device_name(0) if cuda else "cpu",
                deepspeed=deepspeed.__version__, torch=torch.__version__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out of the median")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--model", default="178M", choices=["tiny", "178M", "1B", "8B"])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--profile-step", type=int, default=0, help="step recorded by hetloco_ds.profiling (0: none)")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--no-trace", dest="trace", action="store_false", help="summary JSON only, no chrome trace")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks, tiny model, on this CPU")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        return smoke(a)
    result = run(a)
    if result is not None:
        print(json.dumps({k: v for k, v in result.items() if k != "step_seconds"}), flush=True)
        if a.out_json:
            with open(a.out_json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


def smoke(a) -> int:
    """Two gloo ranks (S = 2), tiny model, a profiled step: the script itself, checked on a CPU."""
    import subprocess
    import tempfile

    from hetloco_ds.launch import free_port

    out = a.out_json or os.path.join(tempfile.mkdtemp(), "stock_smoke.json")
    prof = a.profile_dir or os.path.join(os.path.dirname(out), "profile")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    args = [sys.executable, os.path.abspath(__file__), "--stages", "2", "--model", "tiny", "--vocab", "256",
            "--mb", "2", "--gas", "2", "--seq", "32", "--steps", "4", "--warmup", "1", "--profile-step", "3",
            "--profile-dir", prof, "--no-trace", "--out-json", out]
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        print(f"stock_pipe smoke: ranks exited {codes}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    code = main()
    # Interpreter teardown still aborts a rank now and then after its results are written and its
    # group destroyed (SIGABRT, "terminate called without an active exception": 1 smoke run in 7
    # on 2 cores, 2026-11-28); nothing is left to do, so the process skips it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
