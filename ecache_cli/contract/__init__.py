"""What several layers share, and nothing else: the decode state a policy reads and the step record it
observes (``state``), per-row fields (``rows``), the hook surface between a policy and the model
(``hooks``), and the words of bad input (``text``, ``lines``). These modules import nothing of ecache
beyond this package (docs/ARCHITECTURE.md)."""
