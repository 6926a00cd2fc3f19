"""Anthropic's Messages protocol: routes, request models, tool and thinking blocks."""
