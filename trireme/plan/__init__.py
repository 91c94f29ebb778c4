"""The layout planner (`trireme plan`, docs/plan.md): layouts through the trainer's own checks
(enumerate.py), parameters per rank (params.py), kept activations (activations.py), peak memory
(memory.py), step time from a rate table (time.py, rates.py, rates/*.json, calibrate.py), the
ranking (planner.py), and a run fitted to its GPU (fit.py: the automatic micro batch and the
train-time memory check). The command is trireme.commands.plan; the CPU measurement the accuracy
tests hold it to is trireme.training.measure."""
