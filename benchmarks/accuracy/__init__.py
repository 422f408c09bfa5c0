"""The accuracy study (issue 30): synchronous training against width 2, plain and with each
staleness correction, with and without int8+EF, on SGD tasks, a standard and a stress language
model, and the NAdamW and Muon recipes. ``python -m benchmarks.accuracy --help``."""
