"""What the benchmarks share among themselves (none of it is a benchmark; what they share with the tests is in
``harness/``): ``chat_stream`` (streaming chats through an OpenAI-compatible server), ``completions_load``
(closed-loop capacity and open-loop load of one-token completions), ``tokenize_bodies`` (``/tokenize`` chat bodies),
``proc_cpu`` (CPU seconds per process and its role), ``vllm_server`` (vLLM's own api server)."""
