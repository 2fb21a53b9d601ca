"""What FP8 costs and how healthy it is: telemetry, health signals, the guard, traced bytes,
the cost model."""
