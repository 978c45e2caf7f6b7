"""Data: record shapes -> (input_ids, labels); a tokenised cache; length-bucketed batches."""
