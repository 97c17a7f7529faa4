"""`strata-tool`: maintenance commands (inspect, synth, ...)."""
