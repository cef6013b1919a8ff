"""The engine worker process (docs/ARCHITECTURE.md §5): ``python -m inference.engine --model NAME ...``.

Django-free. Split by job, as vLLM's engine is:

* ``core.EngineCore``: the replica's loop. Each iteration polls the link, hands the requests and aborts it read to
  the scheduler (and aborts those of api processes that vanished), publishes the outputs that returned, then runs
  one scheduler step and publishes each part of its outputs as the step yields it (a newcomer's first tokens go out
  before the running batch's decode); signals stop it.
* ``replica_link.ReplicaLink``: the Redis I/O (request streams, take-over of dead replicas, aborts, output flush,
  heartbeat, step-loop watchdog, withdrawal, the prefix cache's block set for the router).
* the schedulers (``base_scheduler.BaseScheduler`` and one per backend: ``scheduler.Scheduler`` over our own
  ``runner.ModelRunner``, ``pooling.PoolingScheduler`` for embedding models, ``vllm_backend.scheduler.VllmScheduler``
  over vLLM's engine): accepting, priority order, aborts, steps. Each call returns its outputs; the link and the
  schedulers never import each other (an import-linter contract in pyproject.toml).

torch and transformers are imported by the model side (the runners, and the schedulers through them; the KV cache,
the output projection, the sampler, the grammar masks), and only when the engine runs: importing this package,
``__main__``, ``core``, ``replica_link`` or ``watchdog`` loads neither, so the command lines parse their arguments
first (``__main__`` imports the scheduler and runner modules once the arguments are read).

Batching design, and why (measured on the 2-core CPU box, tiny Qwen3 demo model, fp32, 16 prompts of
20-35 tokens, 64 new tokens each, greedy):

* transformers 5.24's continuous-batching manager (``model.generate_batch`` /
  ``init_continuous_batching``, paged cache, block size 32): 590 tokens/s at batch 16, against 633 for
  ``model.generate`` batched with left padding on the same prompts -- slower than the baseline even
  before adding what it lacks (per-request seeds, top-k logprobs, penalties, logit_bias, min_tokens,
  stop ids), and its own background thread and per-request processor hooks would add per-token
  Python work on top.
* Chosen: a compact scheduler of our own (``scheduler.Scheduler``) around the model's own forward
  (``runner.ModelRunner``). The batch KV cache is a preallocated buffer with one row ("slot") per running
  sequence (``kv_cache.SlotKVCache``): a sequence takes a slot when its prefill starts and frees it when it
  ends, so joining and leaving copy nothing; a decode step is one forward over the slots with a per-row 4-D
  attention mask; memory is bounded by ``max_num_seqs × max_model_len`` positions (both grow by doubling on
  demand up to that). Sampling is batched over rows with per-request ``random.Random(seed)`` draws (inverse
  CDF), so seeded outputs do not depend on batch companions. Measured (right-aligned DynamicCache design, before
  the slot cache): 929 tokens/s at batch 16 greedy (generate: 668), 774 with temperature 1 (generate with
  sampling: 194), 83 tokens/s at batch 1 (generate: 72).
* Chunked prefill: each step first spends what its decodes leave of ``--max-num-batched-tokens`` (default 512 on
  CPU, 2048 on CUDA; one token per running sequence) on prompt chunks and newcomers, hands their first tokens out,
  then decodes every sequence that was running when the step began, so a long prompt delays the running decodes by
  one chunk's forward per step instead of its whole prefill (``bench/long_prefill.py``), and a newcomer's first token
  does not wait for the running batch's decode. ``--no-enable-chunked-prefill`` prefills whole prompts. The VL runner
  prefills whole prompts (M-RoPE and image embeddings are computed for the whole prompt).
* Prefix sharing: automatic prefix caching of full prompt blocks, salted per tenant (``prefix_cache.py``;
  ``num_cached_tokens`` reports the prompt tokens it served); a hit is copied into the sequence's slot.
* Not provided: paged attention (a block pool shared between sequences), linear-attention / hybrid cache
  layers (full and sliding-window attention only), CUDA graphs and ``torch.compile`` (no GPU to measure
  whether they pay: ``bench/gpu_check.sh`` is the script to decide it on one).
"""
