"""The benchmark and asynchzp-ab: arms, local launch, shipped corpus, records, the report, and the planner's checks of
runs (the models are in `ds_asynchzp.models`)."""
