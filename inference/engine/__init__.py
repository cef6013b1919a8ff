"""The engine worker process (DESIGN.md §5): ``python -m inference.engine --model NAME ...``.

Django-free; torch and transformers are imported only inside this package (``runner``), and only
when the engine runs, so importing ``inference.engine`` stays cheap.

Batching design, and why (measured on the 2-core CPU box, tiny Qwen3 demo model, fp32, 16 prompts of
20-35 tokens, 64 new tokens each, greedy):

* transformers 5.24's continuous-batching manager (``model.generate_batch`` /
  ``init_continuous_batching``, paged cache, block size 32): 590 tokens/s at batch 16, against 633 for
  ``model.generate`` batched with left padding on the same prompts -- slower than the baseline even
  before adding what it lacks (per-request seeds, top-k logprobs, penalties, logit_bias, min_tokens,
  stop ids), and its own background thread and per-request processor hooks would add per-token
  Python work on top.
* Chosen: a compact scheduler of our own (``core.EngineCore``) around the model's own forward
  (``runner.ModelRunner``): one transformers ``DynamicCache`` for the running batch with
  right-aligned rows (each row's newest token in the last column), newcomers prefilled in one
  left-padded forward and merged between steps, finished/aborted rows removed and all-padding columns
  trimmed, so KV memory is bounded by ``max_num_seqs × max_model_len`` positions. Sampling is batched
  over rows with per-request ``random.Random(seed)`` draws (inverse CDF), so seeded outputs do not
  depend on batch companions. Measured: 929 tokens/s at batch 16 greedy (generate: 668), 774 with
  temperature 1 (generate with sampling: 194), 83 tokens/s at batch 1 (generate: 72).
* Prefix sharing: automatic prefix caching of full prompt blocks, salted per tenant (``prefix_cache.py``;
  ``num_cached_tokens`` reports the prompt tokens it served).
* Not provided: paged attention, chunked prefill
  (a prompt is prefilled in one forward; ``--max-prefill-tokens`` bounds the tokens per prefill
  group), sliding-window / hybrid cache layers (only full-attention ``DynamicLayer`` caches).
"""
