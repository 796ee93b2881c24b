"""evidence: `mobile-moe reproduce FIGURE` - the paper's Fig. 1 and 3a-e as sweeps of runs, tables, CSVs and plots."""
