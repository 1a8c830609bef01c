"""Paged KV cache, the jitted device step, and the dynamic generator host loop."""

from paged.embeddings import MMEmbedding
from paged.errors import GeneratorError, InvalidJobError, InvalidSettingsError, JobTooLargeError
from paged.host.generator import DynamicGenerator
from paged.job import Job
from paged.settings import SamplingSettings

__all__ = ["DynamicGenerator", "GeneratorError", "InvalidJobError", "InvalidSettingsError", "Job",
           "JobTooLargeError", "MMEmbedding", "SamplingSettings"]
