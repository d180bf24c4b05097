"""Drafter training from a target GGUF alone (the optional extra ``[train]``; needs PyTorch).

    from pyllama_dspark.train import TrainOptions, run
    report = run(TrainOptions(target=Path("t.gguf"), prompts=Path("p.jsonl"), outfile=Path("d.gguf"), steps=500))
    print(report.summary())

Phases (each resumes from the work directory): data (the target's own continuations with dense capture
of the taps and its last layer, f16 shards), training (the DeepSpec objective on a PyTorch module that
computes what the dflash graph computes), export (a DeepSpec-layout checkpoint folder, converted by
``pyllama_dspark.convert``), evaluation (plain vs speculative decoding of held-out prompts).
Only this subpackage imports torch.
"""

from .settings import TrainError, TrainSettings, WorkDir  # noqa: F401  (torch-free)


def __getattr__(name):
    # the torch-dependent parts load on first use, so `TrainError` & co import without torch
    if name in ("TrainOptions", "TrainReport", "run", "evaluate"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
