"""Generation: the continuous-batching engine over a paged KV cache (engine.py, scheduler.py,
blocks.py, runner.py, graphs.py, compiled_*.py), sampling, loading a checkpoint for inference
(loading.py), offline batches (batch.py), and the OpenAI-compatible HTTP server (server.py,
openai_api.py)."""
