"""Named exceptions of the generator. Each is raised at `Job()`/`enqueue()` time, before the job touches the
generator, so a rejected job never disturbs the jobs already running."""


class GeneratorError(Exception):
    """Base class for generator errors."""


class InvalidSettingsError(GeneratorError, ValueError):
    """A sampling setting is out of range (e.g. negative temperature, top_p outside (0, 1])."""


class InvalidJobError(GeneratorError, ValueError):
    """A job's inputs are malformed: empty prompt, non-integer or out-of-vocabulary ids, bad stop conditions, ..."""


class JobTooLargeError(GeneratorError, ValueError):
    """The job can never fit: prompt + max_new_tokens exceeds max_seq_len, or needs more pages than the cache has."""
