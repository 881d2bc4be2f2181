"""The trainable DFlash drafter (drafter.py) and the frozen target that feeds it hidden states
(target.py). Import the submodules: the package imports nothing, so that a process that needs only
the drafter's config (the launcher's preflight) does not pay for transformers' model classes."""
