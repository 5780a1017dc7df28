"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    # Batching
    max_num_seqs: int = 8  # running sequences per step (vLLM --max-num-seqs)
    max_num_batched_tokens: int = 512  # per-step token budget = prefill chunk size
    max_waiting: int = 256  # queued requests beyond which submit raises EngineOverloaded
    # A request whose client has not read its oldest event for this long, or
    # has more events unread, is aborted (engine.RequestStream).
    stream_stall_timeout_s: float = 60.0
    stream_max_unread: int = 4096
    # KV pool
    block_size: int = 16  # tokens per KV block (see docs/engine notes in kv/block_pool.py)
    num_blocks: int | None = None  # overrides kv_cache_gb when set
    kv_cache_gb: float = 1.0  # pool size (K + V, all layers)
    kv_dtype: str | None = None  # "float32" | "float16" | "bfloat16"; None = kv.block_pool.default_kv_dtype
    # KV scheme: "off" (dense kv_dtype) | "8" | "4" (affine groups) | "turbo" (= "turbo:k8v3")
    # | "turbo:k<4|8>v<2|3|4>" (TurboQuant values); see kv/schemes.py
    kv_quant: str = "off"
    kv_group_size: int = 64  # affine group size along head_dim (64 or 32)
    max_model_len: int | None = None  # None: model max_position_embeddings, capped by the pool
    enable_prefix_cache: bool = True
    model_fingerprint: str = ""  # prefix-cache namespace; "" = derived from the model config
    # Speculative decoding (engine/spec.py): None = off | "ngram" (prompt lookup) | "model"
    spec_kind: str | None = None
    num_draft_tokens: int = 8  # drafts per row and step, at most (each row adapts below it)
    ngram_min: int = 1  # prompt lookup: the shortest trailing n-gram looked up
    ngram_max: int = 4  # ... and the longest (tried first)
    # "adaptive": the drafts worth their cost (engine/spec.py select); "all":
    # every proposed token, as mlx-lm and vLLM verify (the steps then do not
    # depend on measured times)
    draft_select: str = "adaptive"
    draft_model: object = None  # spec_kind "model": a loaded model sharing the tokenizer (engine/draft.py)
    # Tensor parallelism: rank 0's engine.distributed.StepChannel (the model is
    # sharded, models/shard.py); None in one process
    tp_channel: object = None
    # Build each plain decode step while the one before it evaluates
    # (Scheduler.plan_ahead; vLLM's --async-scheduling)
    async_scheduling: bool = True
    # A step whose sampled rows are all plain greedy has the head choose their
    # tokens (ops.quantized_argmax: the same tokens, most fp32 logits skipped)
    head_choice: bool = True
    # Attention path: None = native kernel where available, else MLX reference
    native_attention: bool | None = None
    # SSD tier of the prefix cache (kv/ssd.py); None = off
    ssd_cache_dir: str | None = None
    ssd_cache_max_gb: float = 32.0  # byte cap of the block files, oldest used evicted
    ssd_demote_idle_s: float | None = None  # spill free cached blocks idle this long, free their RAM
    ssd_cache_verify: bool = True  # check each block's data checksum on restore (header: always)
    ssd_flush_timeout_s: float = 30.0  # on shutdown: wait this long for pending writes
    ssd_restore_timeout_s: float = 30.0  # a block read not done by then is abandoned (prompt computed)
