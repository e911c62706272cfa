"""What a run reports: the metrics stream with its EMA copies, TensorBoard/W&B, the Echo-Trap
warning and sample trajectories (metrics), the PNG curves (plots), the end-of-run tables
(summary), and the numeric helpers they share (stats)."""
