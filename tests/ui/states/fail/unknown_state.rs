// Every name in the table is a variant: both misspellings are reported.
#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending => [Payed, Cancelled], Piad => [Shipped])]
enum OrderStatus {
    Pending,
    Paid,
    Shipped,
    Cancelled,
}

fn main() {}
