"""Long Range Arena data: TFDS builders, offline generators and grain input pipelines."""
