"""The node engine's one config object, validated at construction (errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("fp32", "bf16", "fp16", "fp8")
WEIGHT_FORMATS = ("fp32", "bf16", "int4")
ACTIVATIONS = ("auto", "bf16", "fp16")


@dataclass(frozen=True)
class EngineConfig:
    """What to serve and how much memory to give it.

    The KV pool is sized from `kv_memory_bytes` unless `num_pages` is given;
    the number of pages actually allocated is reported by `EngineStats`.
    """

    model: str = "smollm2"
    kv_dtype: str = "fp32"
    weights: str = "int4"  # the GGUF's own 4-bit blocks; see docs/choices.md
    # What the model computes in: auto is weights.activation_dtype's rule (bf16 on a GPU,
    # fp32 on the CPU); fp16 (INT4 weights on a GPU only) runs the tensor-core W4A16
    # kernels' cheaper fp16 dequantization, at fp16's narrower range.
    activations: str = "auto"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None  # default: the model's context window
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Fair prefill (scheduler/scheduler.py): a prompt with more tokens than this left is
    # long, held to this many a step while others wait; None: a quarter of the budget; 0: off.
    long_prefill_tokens: int | None = None
    reserve_pages: int = 0
    seed: int = 0
    # Page-ownership checks before each step and inside the kernels. Off only to
    # measure what they cost (benchmarks/bench_paged_attention.py).
    check_integrity: bool = True
    # Prefix caching (gpu_node/engine/prefix_cache.py): full prompt pages kept beside the pool,
    # this many; 0 turns it off.
    prefix_cache_blocks: int = 0
    # On a GPU, decode steps of up to this many sequences replay CUDA graphs
    # (gpu_node/engine/decode_graphs.py) instead of launching each kernel from Python; 0: never.
    cuda_graph_batch: int = 32
    # On a GPU, the other steps (prefill, mixed, larger decode batches) of up to this many
    # tokens replay CUDA graphs piece by piece, attention run eagerly between the pieces
    # (gpu_node/engine/step_graphs.py); 0: never. Capped at max_num_batched_tokens.
    cuda_graph_tokens: int = 2048
    # Ranks the model is split across (gpu_node/parallel/): one process and one GPU each.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.kv_dtype not in KV_DTYPES:
            problems.append(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        if self.weights not in WEIGHT_FORMATS:
            problems.append(
                f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}"
            )
        if self.activations not in ACTIVATIONS:
            problems.append(
                f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}"
            )
        elif self.activations == "fp16" and self.weights != "int4":
            problems.append(
                f"activations fp16 takes int4 weights (they run the fp16 W4A16 kernels); "
                f"{self.weights} weights compute in their own dtype: use activations auto"
            )
        if self.tensor_parallel < 1:
            problems.append(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.page_size <= 0 or self.page_size % 8:
            problems.append(f"page_size must be a positive multiple of 8, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            problems.append(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_memory_bytes <= 0:
            problems.append(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            problems.append(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_num_seqs <= 0:
            problems.append(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            problems.append(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_tokens is not None and self.long_prefill_tokens < 0:
            problems.append(f"long_prefill_tokens must be >= 0, got {self.long_prefill_tokens}")
        if self.cuda_graph_batch < 0:
            problems.append(f"cuda_graph_batch must be >= 0, got {self.cuda_graph_batch}")
        if self.cuda_graph_tokens < 0:
            problems.append(f"cuda_graph_tokens must be >= 0, got {self.cuda_graph_tokens}")
        if self.prefix_cache_blocks < 0:
            problems.append(f"prefix_cache_blocks must be >= 0, got {self.prefix_cache_blocks}")
        if self.reserve_pages < 0:
            problems.append(f"reserve_pages must be >= 0, got {self.reserve_pages}")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))
