"""What recorded runs mean: summaries, comparisons and named baselines."""
