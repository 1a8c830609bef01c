"""The host loop: the page pool (`page_pool`), the scheduler under the policies (`scheduler`), turning samples into
result dicts (`job_output`), and the `generator` (DynamicGenerator) with its asyncio face (`async_generator`)."""
