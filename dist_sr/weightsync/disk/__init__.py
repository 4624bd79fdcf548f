"""Weights on disk for engines that (re)start: ``snapshot`` writes versioned snapshots (dense
bases and delta chains), ``materialize`` turns the newest one that verifies into a checkpoint an
engine serves."""
