"""vLLM's engine as an engine backend behind our Redis link (docs/ARCHITECTURE.md §12, README 'Engine backends').

``python -m inference.engine.vllm_backend --model NAME --model-dir DIR ...`` runs in the virtual environment
that holds vLLM (``.peer/vllm``, made by ``scripts/setup.sh --vllm``; its pins clash with ours), with this
repository on ``PYTHONPATH``: our side needs only ``redis``, ``msgpack`` and ``psutil`` (the replica link), and
``numpy``, ``llguidance`` and torch (the shared scheduler code imports the native runner's modules), all there.
``scheduler.VllmScheduler`` runs vLLM's engine behind the same link and core loop as the native engine
(``runner.VllmRunner`` holds the engine); ``params`` maps the wire types (importable without vLLM).
"""
