"""Project tools: tiny-model training, the recall task, demo data generation."""
