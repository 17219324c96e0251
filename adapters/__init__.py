"""What adapts blink's engine to the outside: wire protocols (wire), bulk runs (bulk), the DecisionConfig export
(export). Each module imports blink; blink imports none of them."""
