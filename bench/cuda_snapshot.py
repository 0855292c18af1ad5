"""What logging GPU scalars costs a real CUDA training step: otel-train's deferred read against `.item()`.

A small MLP (bf16 matmuls, Adam) trains on the GPU; every step logs 8 device scalars (loss, grad norm, LR,
loss scale, ...). Modes, each a fresh process, interleaved, median of `--reps`:

- `off`: the same loop, nothing logged (the floor);
- `deferred`: `ot.log` of the device tensors: otel-train copies them on the device in one `torch.stack`
  (no host sync) and reads them per export window off the training thread;
- `item`: `ot.log({k: v.item()})`, the usual habit: one host sync per value, every step;
- `item_once`: `ot.log(dict(zip(keys, torch.stack(values).tolist())))`: one host sync per step.

It prints wall time per step and each mode's ratio to `off`, then checks (untimed) that the deferred values
that landed in JSONL are the values the tensors had at the call although the loop mutates them afterwards.
Without CUDA it says so and exits 0.

    python bench/cuda_snapshot.py --steps 1500 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "deferred", "item", "item_once")
KEYS = ("loss", "grad_norm", "lr", "loss_scale", "w_norm", "act_mean", "act_max", "tokens")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # `cpu`: a dry run of the code paths
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--verify", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args, args.child)
    if args.verify:
        return _verify(args, Path(args.verify))
    try:
        import torch
    except ImportError:
        print("no torch: nothing to measure")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run this on a GPU machine)")
        return 0
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu dry run'}, torch {torch.__version__}; MLP {args.layers}x{args.hidden}, batch "
          f"{args.batch}, bf16, {len(KEYS)} device scalars logged per step, {args.steps} steps, median of {args.reps}")
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else reversed(MODES):  # interleaved, order alternating
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--warmup",
                                  str(args.warmup), "--hidden", str(args.hidden), "--layers", str(args.layers),
                                  "--batch", str(args.batch), "--device", args.device], capture_output=True, text=True, check=False)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                print(f"{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
                return 1
            results[mode].append(json.loads(line[0][7:])["us_per_step"])
    floor = statistics.median(results["off"])
    print("\n| mode | µs/step (median) | runs | vs off |")
    print("|---|---|---|---|")
    for mode in MODES:
        med = statistics.median(results[mode])
        runs = ", ".join(f"{v:.0f}" for v in results[mode])
        print(f"| {mode} | {med:.1f} | {runs} | {med / floor:.3f}x |")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, __file__, "--verify", tmp, "--hidden", str(args.hidden), "--layers",
                              str(args.layers), "--batch", str(args.batch), "--device", args.device],
                             capture_output=True, text=True,
                             check=False)
        print(out.stdout.strip() or out.stderr[-3000:])
        return out.returncode


def _model(args: argparse.Namespace) -> tuple[object, object, object]:
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(args.device).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.hidden, device=args.device, dtype=torch.bfloat16)
    return model, opt, x


def _step(model: object, opt: object, x: object, lr: object, scale: object, tokens: object) -> dict[str, object]:
    """One training step; returns its 8 device scalars (nothing read on the host)."""
    import torch

    out = model(x)  # type: ignore[operator]
    loss = out.float().pow(2).mean()
    opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    (loss * scale).backward()
    params = [p for p in model.parameters() if p.grad is not None]  # type: ignore[attr-defined]
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
    opt.step()  # type: ignore[attr-defined]
    w_norm = torch.linalg.vector_norm(params[0].detach().float())
    return {"loss": loss.detach(), "grad_norm": grad_norm, "lr": lr, "loss_scale": scale, "w_norm": w_norm,
            "act_mean": out.detach().float().mean(), "act_max": out.detach().float().amax(), "tokens": tokens}


def _child(args: argparse.Namespace, mode: str) -> int:
    import torch

    import otel_train as ot

    tmp = tempfile.mkdtemp()
    ot.init(exporters="jsonl", dir=tmp, run_name=mode, disabled=mode == "off")
    model, opt, x = _model(args)
    lr = torch.tensor(1e-4, device=args.device)
    scale = torch.tensor(1024.0, device=args.device)
    tokens = torch.zeros((), device=args.device)
    t0 = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            _sync(args)
            t0 = time.perf_counter()
        with ot.step(i):
            values = _step(model, opt, x, lr, scale, tokens)
            if mode == "deferred":
                ot.log(values)
            elif mode == "item":
                ot.log({k: v.item() for k, v in values.items()})  # type: ignore[attr-defined]
            elif mode == "item_once":
                ot.log(dict(zip(values, torch.stack([v.float() for v in values.values()]).tolist())))  # type: ignore[attr-defined]
            lr.mul_(0.999)  # mutated in place after logging, as a scheduler does
            tokens.add_(args.batch)
    _sync(args)
    elapsed = time.perf_counter() - t0
    ot.shutdown()
    print("RESULT " + json.dumps({"us_per_step": elapsed / args.steps * 1e6}))
    return 0


def _sync(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def _verify(args: argparse.Namespace, tmp: Path) -> int:
    """Untimed: the deferred values in JSONL are the values at the call, though the loop mutates them after."""
    import torch

    import otel_train as ot
    from otel_train.exporters.jsonl import read_jsonl
    from otel_train.vocab.run_paths import run_folder

    ot.init(exporters="jsonl", dir=str(tmp), run_name="verify", export_every=50)
    model, opt, x = _model(args)
    lr = torch.tensor(1e-4, device=args.device)
    scale = torch.tensor(1024.0, device=args.device)
    tokens = torch.zeros((), device=args.device)
    expected: list[tuple[str, int, float]] = []
    for i in ot.steps(range(200)):
        values = _step(model, opt, x, lr, scale, tokens)
        ot.log(values)
        expected += [(k, i, float(v.float().item())) for k, v in values.items()]  # type: ignore[attr-defined]
        lr.mul_(0.5)
        scale.mul_(0.5 if i % 2 else 2.0)
        tokens.add_(args.batch)
    ot.shutdown()
    got = [(r["name"], r["step"], r["value"]) for r in read_jsonl(run_folder(tmp, "verify") / "rank0.jsonl")
           if r.get("type") == "metric" and r["name"] in KEYS]
    got.sort(key=lambda r: (r[1], KEYS.index(r[0])))
    expected.sort(key=lambda r: (r[1], KEYS.index(r[0])))
    missing = sorted({r[:2] for r in expected} - {r[:2] for r in got})
    wrong = sum(1 for a, b in zip(got, expected) if a[:2] != b[:2] or abs(a[2] - b[2]) > 1e-6 * max(1.0, abs(b[2])))
    ok = len(got) == len(expected) and wrong == 0
    if missing:
        print(f"missing: {missing[:10]}")
    print(f"verify: {len(got)} of {len(expected)} device values in JSONL, {wrong} differing from the value at the "
          f"call (lr and loss scale mutated in place after every log): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
