"""One-line integrations with training frameworks that build the engine for the user.

- :mod:`distgrad.integrations.hf`: the Hugging Face ``Trainer`` (and trainers built on it, such as
  TRL's) and plain Accelerate loops; ``pip install distgrad[hf]``.
- :mod:`distgrad.integrations.lightning`: PyTorch Lightning; ``pip install distgrad[lightning]``.

Each reads the step's reduced gradient before the framework clips it, and reports
``distgrad_loss`` as the mean training loss of the optimizer step over all micro-batches and
ranks, whatever scaling the framework applies before backward (see docs/metrics.md). The core
package never imports these frameworks; each module imports its framework when imported.
"""
