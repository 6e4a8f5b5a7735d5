"""The proxy's API layer: HTTP (app), the OpenAI request and response shapes (openai_api, responses, openapi),
and output processing (serving). It calls proxy/routing/ to run a request; routing never imports it."""
