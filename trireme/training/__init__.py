"""A training run: built from one config (build.py), the outer loop (loop.py) with its health
checks (health.py), run files (run_files.py), checkpoints of the run (checkpoints.py), the
end-of-training sample (sample.py), and `train(cfg)` (train.py), the public entry point."""
