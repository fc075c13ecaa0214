// Each transition is declared once, also across rules.
#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending => [Paid, Cancelled], Paid => Shipped, Pending => Paid)]
enum OrderStatus {
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

fn main() {}
