"""Callbacks that give a framework's training loop what ``Guard`` gives a loop of one's own.

``lossguard.agent.integrations.huggingface.LossguardCallback`` (``transformers.Trainer``; the
``huggingface`` extra) and ``lossguard.agent.integrations.lightning.LossguardCallback``
(PyTorch Lightning; the ``lightning`` extra). Importing this package imports neither framework
nor torch: each module imports its framework when it is imported itself.
"""
