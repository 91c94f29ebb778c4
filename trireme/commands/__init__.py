"""The `trireme` subcommands that import torch (trireme.cli dispatches to them): train, generate,
serve, preprocess / data / tokenizer, convert / inspect, plan. Each parses its arguments and calls
the package's code; none holds logic of its own beyond that."""
