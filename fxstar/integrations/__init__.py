"""fxstar inside the training tools people already use.

`fxstar.integrations.transformers.FxstarTrainer` is Hugging Face's `Trainer` with an fxstar
`Plan`: the Trainer keeps its loop, arguments, callbacks, logging and checkpoint directories;
the compiled engine runs the forward, backward, optimizer update and checkpoint state.
Importing it needs `transformers` and `accelerate` (the `hf` extra).
"""
