"""The instrument: one object per run that finds the reduced gradients at each optimizer-step
boundary, issues the step's collectives and hands the record to the diagnostics and exporters."""
