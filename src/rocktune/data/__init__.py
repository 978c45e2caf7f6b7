"""Data: record shapes -> (input_ids, labels); a tokenised cache; micro-batches in data.batch_order."""
