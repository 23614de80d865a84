"""The run plumbing around a trainer's loop: config and flags, the accelerator and output folder, checkpoints and
resume, validation, the model card and the hub, the launcher, FSDP2 / ZeRO state."""
