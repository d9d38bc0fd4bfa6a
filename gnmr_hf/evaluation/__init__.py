"""Scoring with lm-evaluation-harness: the bundled GSM8K / MMLU / HellaSwag / WikiText-2 script."""
