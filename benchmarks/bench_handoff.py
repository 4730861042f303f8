"""What a prefill/decode KV handoff costs beside the prefill it saves the decode node.

    TRITON_INTERPRET=0 python3 benchmarks/bench_handoff.py      # GPU: seeded 16-layer llama
    .venv/bin/python benchmarks/bench_handoff.py --smoke         # tiny model on the CPU (CI)

For each prompt length, side by side in one run: a normal request's prefill (one
step to its first token), the same prompt prefill-only (the step plus exporting its
KV rows), then the handoff's wire format both ways and the import into another
engine's pool. Bytes are what crosses the network between the two nodes. Median of
`--repeats`. Imports only torch, triton, numpy and our code.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import LLAMA_1B, TINY, make_engine, sync

from gpu_node.engine.handoff import KVHandoff, import_rows
from gpu_node.models.weights import seeded_llama
from scheduler.sequence import SamplingParams


def timed(fn, device: str) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3, out


def run(engine, ids, **kwargs):
    engine.add_request("r", ids, SamplingParams(max_tokens=1, ignore_eos=True), **kwargs)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, short prompts, CPU")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--kv-dtype", default="fp8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.repeats = "64,128", 1
    device = "cpu" if args.smoke else "cuda"
    shape = TINY if args.smoke else LLAMA_1B
    model = seeded_llama(shape, seed=0, device=device)
    model = model.to(torch.float32 if args.smoke else torch.bfloat16)
    lengths = [int(n) for n in args.lengths.split(",")]
    pages = max(lengths) // 16 + 8
    overrides = {
        "kv_dtype": args.kv_dtype,
        "num_pages": pages,
        "max_num_batched_tokens": max(lengths),
    }
    prefiller, plain, decoder = (make_engine(model, device, **overrides) for _ in range(3))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}; {shape.num_layers} layers x {shape.hidden_size}, {args.kv_dtype} KV")
    print(
        "| prompt | prefill ms | prefill + export ms | to bytes ms | from bytes ms | import ms | MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in lengths:
        ids = [(j * 131) % (shape.vocab_size - 1) + 1 for j in range(n)]
        rows: dict[str, list[float]] = {k: [] for k in ("plain", "prefill", "to", "from", "import")}
        size = 0
        for _ in range(args.repeats + 1):  # the first round warms up (compiles)
            t_plain, _ = timed(lambda i=ids: run(plain, i), device)
            t_prefill, out = timed(lambda i=ids: run(prefiller, i, prefill_only=True), device)
            handoff = out.handoff
            t_to, data = timed(handoff.to_bytes, device)
            t_from, back = timed(lambda d=data: KVHandoff.from_bytes(d), device)
            table = list(range(-(-n // 16)))
            t_import, _ = timed(lambda b=back, t=table: import_rows(decoder.kv_cache, t, b), device)
            for key, value in zip(rows, (t_plain, t_prefill, t_to, t_from, t_import), strict=True):
                rows[key].append(value)
            size = len(data)
        med = {k: statistics.median(v[1:]) for k, v in rows.items()}
        print(
            f"| {n} | {med['plain']:.2f} | {med['prefill']:.2f} | {med['to']:.2f} | "
            f"{med['from']:.2f} | {med['import']:.2f} | {size / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
