"""What recorded runs mean: summaries, comparisons and named baselines."""

# How a summary, and a comparison of runs or baselines (text only: no Parquet), can be written;
# here, where nothing loads polars, so that the commands' --help reads them at start-up.
SUMMARY_FORMATS = ("table", "markdown", "csv", "json", "parquet")
COMPARE_FORMATS = SUMMARY_FORMATS[:-1]
