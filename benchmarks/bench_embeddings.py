"""Sentence embeddings: sentences/s of our encoder at batch 1 and 64, beside
sentence-transformers on the same model, machine and sentences.

    .venv/bin/python benchmarks/bench_embeddings.py [--model DIR] [--device cpu|cuda]
    .venv/bin/python benchmarks/bench_embeddings.py --smoke     # a tiny BERT, seconds (CI)

The model is all-MiniLM-L6-v2 (`edgeserve model pull minilm`) unless --model names another
BERT checkpoint directory. Sentences are 8 to 40 words, the same for both; each rate is
the median of --rounds rounds, ours and the peer alternated. The peer runs only where
sentence-transformers is installed (it is not a dependency of ours).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_node.engine.embedder import Embedder

# Common English words and a few of the domain's, drawn at random into sentences.
WORD_LIST = (
    "the a of to and in is it that was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name Paris Rome river mountain engine "
    "kernel token vector cache"
)
WORDS = WORD_LIST.split(" ")


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))) + "." for _ in range(n)]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ours_rate(embedder: Embedder, texts: list[str], batch: int, device: str) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        embedder.embed(embedder.tokenize(texts[i : i + batch]))
    synchronize(device)
    return len(texts) / (time.perf_counter() - start)


def peer_rate(model, texts: list[str], batch: int, device: str) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        model.encode(texts[i : i + batch], batch_size=batch, convert_to_tensor=True)
    synchronize(device)
    return len(texts) / (time.perf_counter() - start)


def tiny_checkpoint(directory: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    BertModel(config).save_pretrained(directory)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz."]
    (directory / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="both sides'")
    parser.add_argument("--smoke", action="store_true", help="a tiny BERT on the CPU, seconds")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.sentences, args.rounds = "cpu", 16, 1
        args.model = tiny_checkpoint(Path(tempfile.mkdtemp()))
    elif args.model is None:
        from gpu_node.models.model_store import pull

        args.model = pull("minilm")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    embedder = Embedder.from_directory(args.model, dtype=dtype, device=args.device)
    try:
        from sentence_transformers import SentenceTransformer

        peer = SentenceTransformer(str(args.model), device=args.device).to(dtype)
    except ImportError:
        peer = None
    texts = sentences(args.sentences)
    tokens = sum(len(t) for t in embedder.tokenize(texts))
    print(f"{args.model.name} {args.dtype} on {args.device} ({torch.get_num_threads()} threads), "
          f"{len(texts)} sentences, {tokens / len(texts):.1f} tokens each")  # fmt: skip
    for batch in (1, 64):
        ours_runs, peer_runs = [], []
        warm = texts[: min(8, len(texts))]
        ours_rate(embedder, warm, batch, args.device)
        if peer is not None:
            peer_rate(peer, warm, batch, args.device)
        for _ in range(args.rounds):
            ours_runs.append(ours_rate(embedder, texts, batch, args.device))
            if peer is not None:
                peer_runs.append(peer_rate(peer, texts, batch, args.device))
        row = {"batch": batch, "edgeserve_sentences_s": round(statistics.median(ours_runs), 1)}
        if peer_runs:
            row["sentence_transformers_sentences_s"] = round(statistics.median(peer_runs), 1)
        print(json.dumps(row), flush=True)
    if args.smoke:
        shutil.rmtree(args.model, ignore_errors=True)


if __name__ == "__main__":
    main()
