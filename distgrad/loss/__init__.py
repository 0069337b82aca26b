"""The training loss per optimizer step: per-rank losses and times, named loss components, per-token
losses, and the loss trend."""
