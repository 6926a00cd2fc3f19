"""OpenAI's Responses protocol: routes and request models."""
