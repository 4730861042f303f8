"""Hugging Face checkpoints at real shapes: time to load, and decode tokens/s, bf16 and INT4.

    python benchmarks/bench_checkpoints.py [--shapes llama3-8b,qwen3-30b-a3b] [--dir D]  # GPU
    .venv/bin/python benchmarks/bench_checkpoints.py --smoke          # CPU, tiny shapes (CI)

Each shape's checkpoint is written once by transformers' own classes (random weights,
bf16, `save_pretrained` in 5 GB shards) under --dir, then loaded through the node's path
(hf_checkpoint.load_hf_model: safetensors shard by shard onto the GPU, INT4 quantized as
each projection arrives) and served by the engine: one request, a 128-token prompt, 128
tokens decoded greedily (CUDA graphs on), and 16 such requests at once.

Beside each rate: the physical limit at batch 1 (the bytes a decode step must read, weights
and the active experts' share, at the copy rate measured on the device in the same run) and
the peer, transformers' own `generate` on the same checkpoint in bf16 (batch 1, its static
cache off and on not tried: its default).

`qwen3-30b-a3b` keeps Qwen3-30B-A3B's layer shapes (128 experts, top-8, expert hidden
768) with 12 of its 48 layers, so the checkpoint fits the device's disk; its load time
and bytes scale with the layers, its decode rate does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.hf_checkpoint import HFCheckpoint, load_hf_model
from gpu_node.models.llama import fuse_projections
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import activation_dtype
from scheduler.sequence import SamplingParams

SHAPES = {
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192},
    )),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        max_position_embeddings=8192, rope_theta=1000000.0,
    )),
    # --smoke: the same two families at toy sizes
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=1024,
    )),
}  # fmt: skip


def write_checkpoint(shape: str, directory: Path, device: str) -> float:
    """Writes the shape's checkpoint unless `directory` holds it; returns its GB."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if not (directory / "config.json").is_file():
        config_name, model_name, fields = SHAPES[shape]
        config = getattr(transformers, config_name)(**fields, tie_word_embeddings=False)
        with torch.device(device):
            model = getattr(transformers, model_name)._from_config(config, dtype=torch.bfloat16)
        partial = directory.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, max_shard_size="5GB")
        del model
        gc.collect()
        torch.cuda.empty_cache() if device == "cuda" else None
        # bytes as tokens (the random model's ids past them decode to nothing)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(partial)
        partial.rename(directory)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) / 1e9


def decode_rate(engine: LLMEngine, streams: int, prompt: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = {f"r{i}": [(7 * i + j) % 250 for j in range(prompt)] for i in range(streams)}
    engine.generate({"warm": prompts["r0"][:16]}, SamplingParams(max_tokens=8, ignore_eos=True))
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    started: set[str] = set()
    while len(started) < streams:  # every prompt prefilled: the rate below is decode alone
        started |= {out.request_id for out in engine.step() if out.token_ids}
    synchronize(engine.config.device)
    start, done = time.perf_counter(), 0
    while engine.has_unfinished():
        done += sum(len(out.token_ids) for out in engine.step())
    synchronize(engine.config.device)
    return done / (time.perf_counter() - start)


def bytes_per_token(model: torch.nn.Module, active_expert_share: float) -> int:
    """The weight bytes one decode step reads: every tensor but the embedding table (one row
    a token), an MoE's experts at the share a token routes to."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name or "rotary" in name or "inv_freq" in name:
            continue
        size = t.numel() * t.element_size()
        total += int(size * active_expert_share) if "experts" in name else size
    return total


def copy_rate(device: str) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted), best of 5."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * (1 << 30) / best


def transformers_rate(directory: Path, device: str, prompt: int, tokens: int) -> float:
    """The peer: transformers' generate, bf16, one request, greedy, `tokens` new tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device_map=device
    )
    ids = torch.tensor([[(7 * j) % 250 for j in range(prompt)]], device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
    synchronize(device)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
    synchronize(device)
    rate = tokens / (time.perf_counter() - start)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(
    shape: str, weights: str, directory: Path, device: str, smoke: bool, bandwidth: float
) -> dict:
    checkpoint = HFCheckpoint(directory)
    dtype = activation_dtype(weights, device)
    synchronize(device)
    start = time.perf_counter()
    model = load_hf_model(checkpoint, dtype, device, int4=weights == "int4")
    if device == "cuda":
        model = fuse_projections(model)
    synchronize(device)
    load_s = time.perf_counter() - start
    resident = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else float("nan")
    config = EngineConfig(
        model=str(directory), weights=weights, device=device, kv_dtype="bf16",
        kv_memory_bytes=(4 << 30) if device == "cuda" else (64 << 20),
        max_model_len=1024, max_num_batched_tokens=2048,
        cuda_graph_batch=16 if device == "cuda" else 0,
        cuda_graph_tokens=0,
    )  # fmt: skip
    moe = checkpoint.config().moe
    step_bytes = bytes_per_token(model, moe.top_k / moe.num_experts if moe else 1.0)
    engine = LLMEngine(config, model, ChatTokenizer.from_directory(directory))
    prompt, tokens = (16, 8) if smoke else (128, 128)
    row = {
        "shape": shape, "weights": weights, "load_s": round(load_s, 2),
        "resident_gb": round(resident, 2), "gb_read_per_token": round(step_bytes / 1e9, 2),
        "roofline_tok_s_b1": round(bandwidth / step_bytes, 1),
        "decode_tok_s_b1": round(decode_rate(engine, 1, prompt, tokens), 1),
        "decode_tok_s_b16": round(decode_rate(engine, 16, prompt, tokens), 1),
    }  # fmt: skip
    del engine, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama3-8b,qwen3-30b-a3b")
    parser.add_argument("--weights", default="bf16,int4")
    parser.add_argument("--dir", type=Path, help="where checkpoints are written and kept")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' rate")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shapes = ["tiny-llama", "tiny-qwen3-moe"] if args.smoke else args.shapes.split(",")
    weights = ["fp32", "int4"] if device == "cpu" else args.weights.split(",")
    if args.dir is None:
        args.dir = Path(tempfile.mkdtemp()) if args.smoke else Path("/tmp/edgeserve-checkpoints")
    bandwidth = copy_rate(device)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"copy rate {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    rows = []
    for shape in shapes:
        directory = args.dir / shape
        directory.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        gb = write_checkpoint(shape, directory, device)
        print(f"{shape}: {gb:.1f} GB of safetensors ({time.perf_counter() - start:.0f} s to have)")
        for w in weights:
            row = run(shape, w, directory, device, args.smoke, bandwidth)
            row["checkpoint_gb"] = round(gb, 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if not args.no_peer:
            prompt, tokens = (16, 8) if args.smoke else (128, 128)
            rate = transformers_rate(directory, device, prompt, tokens)
            dtype = "bf16" if device == "cuda" else "fp32"
            peer = {"shape": shape, "peer": f"transformers generate, {dtype}",
                    "decode_tok_s_b1": round(rate, 1)}  # fmt: skip
            print(json.dumps(peer), flush=True)
            rows.append(peer)
        if args.smoke:
            shutil.rmtree(directory)
    if args.smoke:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
