"""prepos's tests, in folders by layer; tests/support holds what they share."""
